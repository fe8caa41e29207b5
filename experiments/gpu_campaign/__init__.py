"""The GPU campaign: on one lent H100, in a few calls of at most 10 minutes,
self-distil SmolLM2 on ShareGPT's questions, train EAGLE-3 and ConFu at equal budgets, benchmark
MT-Bench, and bring back heads, results and the data release. Step by step: experiments/GPU_CAMPAIGN.md.

    # here (network): wheels, prompts, assets and the model in two chunks under .gpu_bundle/
    python -m experiments.gpu_campaign bundle
    python -m experiments.gpu_campaign calls                  # the device `run` calls to issue, in order
    # on the GPU machine, every call (the carried bundle folder differs per call)
    bash experiments/gpu_campaign.sh                      # = python3 -m experiments.gpu_campaign run --out $OUT
    # here again: check and extract what came back
    python -m experiments.gpu_campaign unpack /work/.device/<call 1 files> ... --dest runs/gpu_campaign

Why calls and chunks: the lent machine has no network, at most 64 MiB of working tree travels per
call, a command runs at most 10 minutes, and the machine keeps the working-tree copy (ignored files
included) only while it stays warm between consecutive calls. So the bundle is split in two
carried folders (call 1: wheels, prompts, MT-Bench / HumanEval files and the first part of the
GGUF; call 2: the rest of the GGUF), and every call runs the same driver, which resumes from its
stage directory (``.gpu_campaign/``, ignored) and stops before the call's time runs out.

Stages (each resumable; a finished stage is skipped; ``state.json`` says where it is):

1. ``setup``   install the carried wheels that the image lacks or holds at another version
               (``pip install --no-deps --no-index --target .gpu_campaign/site``), put MT-Bench and
               HumanEval where ``confu_jax.assets`` finds them, unpack the prompt file;
2. ``model``   collect the GGUF chunks over the calls, reassemble, check the file's sha256 and that
               ``load_model('smollm2-135m-instruct')`` gives the same f32 weights as here (sha256 of
               every dequantised tensor): the GGUF is shipped as is, the asset name resolves to it;
3. ``data``    ``launch.generate_data`` (continuous batching, batch >= 256) on ShareGPT's user turns,
               skipping the conversations ``releases/data/sharegpt_smollm2`` holds (``--release``),
               until the token target or the stage's time box;
4. ``release`` pack it as the data release ``sharegpt_smollm2_gpu`` (``confu_jax.data.releases``:
               hashed zstandard parts <= 10 MB + manifest), answer tokens counted in parallel;
5. ``eagle3``  ``launch.train`` EAGLE-3 for E + P steps (rows of ``train_len`` tokens, packed); the
               step count is re-planned once from the measured step time to fit the time left;
6. ``confu``   ConFu from EAGLE-3's step E for P steps (the paper's protocol, as experiments/headline.sh):
               both heads see E + P steps of the same batches' size;
7. ``bench``   ``launch.decode_bench`` on MT-Bench: AR, EAGLE-3, ConFu, lookup, hybrid; chain:3, a
               60-node dynamic tree, budget auto; tau, speed-up over AR on this GPU, lossless check;
   each head is exported when trained: EAGLE-3 in the official format (``launch.export_head``,
   bf16), ConFu as a bf16 safetensors of its trainable tree + config (``export_confu``).

What comes back (``$OUT``, every call): ``status.json`` (stages, numbers, what was delivered),
``call-NN.log``, and the artifacts finished since the last call as tar pieces of <= 15 MiB
(``results``, ``eagle3_head``, ``confu_head``, ``data_release``), at most 8 files and 64 MiB.

Offline target features (``launch.target_features``) are not used: at 3.73 GB per million tokens
20 M tokens would need ~75 GB, more than the machine's 64 GB disk, and ConFu recomputes the target
pass anyway (it needs per-layer K/V).

Scale: every knob of ``Scale`` can be set with ``CAMPAIGN_<NAME>`` (e.g. ``CAMPAIGN_E3_STEPS=300``);
``CAMPAIGN_SCALE=tiny`` (or ``--scale tiny``) is the CPU dry run of tests/e2e/test_gpu_campaign.py.
This driver imports only the standard library: every piece of work runs in a subprocess (a stage
command, or ``python -m experiments.gpu_campaign step <name>``), so the driver never holds the GPU.

Modules: ``common`` (constants, ``Scale``, helpers), ``bundle`` (here: the bundle and the calls),
``driver`` (there: ``Campaign``, ``cmd_run``) with its stages in ``stages_data`` (setup, model, data,
release) and ``stages_train`` (eagle3, confu, families, bench), ``steps`` (pieces run in their own
process, the ConFu export), ``unpack`` (here again), ``__main__`` (the command line).
"""
