import os
import sys
from pathlib import Path

# Offline, quiet Flower and Hugging Face for every test.
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# The isoloco-lm app's package (``import isoloco_lm``), for the tests that drive it in-process.
_LM_APP_DIR = str(Path(__file__).resolve().parents[1] / "simulations" / "isoloco-lm")
if _LM_APP_DIR not in sys.path:
    sys.path.insert(0, _LM_APP_DIR)
