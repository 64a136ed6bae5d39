"""A quickstart-style Flower app (``@app.train`` / ``@app.evaluate`` only)."""
