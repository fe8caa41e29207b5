"""What the tests share: fakes of the models, fixtures, the suite's XLA flags, the registry-wide
family checks. Imported one way only: ``from tests.helpers.<module> import ...``."""
