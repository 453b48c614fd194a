"""The OpenAI-compatible HTTP front (see app.py)."""
