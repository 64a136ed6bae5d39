"""flwr-isoloco: DiLoCo, IsoLoCo and RW-LoRA for the Flower federated learning framework."""

__version__ = "0.1.0"
