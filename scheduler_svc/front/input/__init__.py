"""A client's request made into a GenerationRequest: validation, structured-output specs, tokenization off the loop."""
