"""``python -m experiments.gpu_campaign``: bundle | set_aside | calls | run | unpack | restore | step."""

from __future__ import annotations

import argparse
import os
import sys

from experiments.gpu_campaign.bundle import cmd_bundle, cmd_calls, cmd_restore, cmd_set_aside
from experiments.gpu_campaign.common import DEFAULT_BUNDLE, DEFAULT_STATE, ROOT
from experiments.gpu_campaign.driver import cmd_run
from experiments.gpu_campaign.steps import step_digest, step_export_confu, step_release
from experiments.gpu_campaign.unpack import cmd_unpack


def _package_doc() -> str:
    import experiments.gpu_campaign as package

    return package.__doc__.split("\n\n")[0]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.gpu_campaign", description=_package_doc(),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("bundle", help="build .gpu_bundle/call1 and call2 here (pip download needs the network)")
    b.add_argument("--out", default=os.environ.get("CAMPAIGN_BUNDLE", DEFAULT_BUNDLE))
    b.add_argument("--model_file", default="", help="GGUF to ship (default: the SmolLM2 asset)")
    b.add_argument("--sharegpt", default="", help="conversation file for the prompts (default: the ShareGPT asset)")
    b.add_argument("--scale", default=os.environ.get("CAMPAIGN_SCALE", "gpu"))
    b.add_argument("--no_wheels", action="store_true", help="bring no wheels (every package is installed there)")
    b.add_argument("--no_reverse", action="store_true", help="keep ShareGPT's order")
    c = sub.add_parser("calls", help="print the device calls for the bundle")
    c.add_argument("--bundle", default=os.environ.get("CAMPAIGN_BUNDLE", DEFAULT_BUNDLE))
    for name, what in (("set_aside", "move the head releases the campaign does not read into <bundle>/set_aside "
                                     "(before call 1: they would travel with every call)"),
                       ("restore", "move them back (after the calls)")):
        a = sub.add_parser(name, help=what)
        a.add_argument("--bundle", default=os.environ.get("CAMPAIGN_BUNDLE", DEFAULT_BUNDLE))
    r = sub.add_parser("run", help="the stage driver (on the GPU machine, every call)")
    r.add_argument("--state", default=os.environ.get("CAMPAIGN_STATE", DEFAULT_STATE))
    r.add_argument("--bundle", default=os.environ.get("CAMPAIGN_BUNDLE", DEFAULT_BUNDLE))
    r.add_argument("--out", default=os.environ.get("OUT") or os.path.join(DEFAULT_STATE, "out"))
    r.add_argument("--scale", default=os.environ.get("CAMPAIGN_SCALE", "gpu"))
    u = sub.add_parser("unpack", help="check and extract what the calls brought back")
    u.add_argument("dirs", nargs="+")
    u.add_argument("--dest", default=os.path.join(ROOT, "runs", "gpu_campaign"))
    u.add_argument("--no_rebuild", action="store_true", help="do not rebuild a workdir for the ConFu head")
    s = sub.add_parser("step", help="internal: one piece of a stage, in its own process")
    s.add_argument("name", choices=["digest", "release", "export_confu"])
    s.add_argument("--out", default="")
    s.add_argument("--input", default="")
    s.add_argument("--release", default="")
    s.add_argument("--level", default="19")
    s.add_argument("--release_name", default="")
    s.add_argument("--commit", default="")
    s.add_argument("--gen_seconds", default="0")
    s.add_argument("--summary", default="")
    s.add_argument("--workdir", default="")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = ap.parse_args(argv)
    if args.cmd == "bundle":
        return cmd_bundle(args)
    if args.cmd == "calls":
        return cmd_calls(args)
    if args.cmd == "set_aside":
        return cmd_set_aside(args)
    if args.cmd == "restore":
        return cmd_restore(args)
    if args.cmd == "run":
        return cmd_run(args)
    if args.cmd == "unpack":
        return cmd_unpack(args)
    return {"digest": step_digest, "release": step_release, "export_confu": step_export_confu}[args.name](args)


if __name__ == "__main__":
    sys.exit(main())
