"""rwlora-sentiment: RW-LoRA / gossip / FedAvg LoRA fine-tuning of all-MiniLM-L6-v2 (Flower app)."""
