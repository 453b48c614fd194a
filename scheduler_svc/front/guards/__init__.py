"""What a caller passes before any handler runs: API keys, TLS, call and byte budgets, key throttling."""
