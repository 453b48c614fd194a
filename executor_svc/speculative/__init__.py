"""Speculative decoding in the executor: verifying proposed tokens against the target model."""
