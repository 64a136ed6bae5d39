"""A quickstart-pytorch-style Flower app: a small CNN on sklearn's 8x8 digits, SGD inner steps."""
