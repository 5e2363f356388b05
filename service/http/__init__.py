"""The HTTP side: the app and its lifespan (app.py), the scoring and health routes (router.py), the
admin routes (admin.py), the OpenAI / vLLM completions surface (completions/), bearer keys (auth.py),
bounded bodies and deadlines (bodies.py), what the routes share (state.py), and the uvicorn process
(server.py). Handlers are a few lines over wire -> normalise -> batcher -> answer."""
