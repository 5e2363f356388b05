"""The scoring subset of the OpenAI / vLLM completions API, token-id prompts only (docs/api.md,
'Completions'): what TRL's VLLMClient.get_sequence_logprobs and lm-evaluation-harness'
local-completions send, answered as vLLM answers them.

    routes    POST /v1/completions, GET /v1/models, GET /health
    schemas   the wire models (CompletionRequest ... ModelList)
    plan      a request -> one SequenceJob per prompt, after the checks that name a field
    response  the jobs' scores -> choices[i].prompt_logprobs (vLLM) and choices[i].logprobs (OpenAI)
    jsonwriter  those two arrays as JSON bytes, by numpy (bytepool: the copies; pieces: per-token text)

It uses the batcher and the error table of /logprobs; the engine sees plain SequenceJobs.
"""
