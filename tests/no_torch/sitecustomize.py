"""Put this folder on PYTHONPATH and the model stack cannot be imported: the processes the API image runs (api,
ingest worker, beat, migrate) are started this way by tests/stack.py, so they prove that image (built without
docker/requirements.py's MODEL_STACK) is enough for them."""

import sys
from importlib.abc import MetaPathFinder

BLOCKED = frozenset({"torch", "transformers", "safetensors", "torchvision"})


class _ModelStackBlocker(MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is not installed in the API image")
        return None


sys.meta_path.insert(0, _ModelStackBlocker())
