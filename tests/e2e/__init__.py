"""The product run from outside: a `python -m service serve` process (drain, tensor parallel, the TRL
and lm-eval clients against /v1/completions), the soak, and schemathesis against the OpenAPI document."""
