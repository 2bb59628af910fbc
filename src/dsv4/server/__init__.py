"""OpenAI-compatible HTTP server with live weight updates (`dsv4 serve`).

    launch.py       `dsv4 serve` arguments -> LLM + app -> uvicorn
    app.py          the FastAPI app: routes, OpenAI-shaped errors, body limits, auth gates
    openai_api.py   /v1/completions, /v1/chat/completions, /v1/models, /tokenize, /detokenize, /health, ...
    admin.py        /admin: pause / resume, weight update sessions, reload, report, weight sync from a trainer
    driver.py       the engine thread, per-request output sinks, the admin thread (operations in order)
    completions.py  requests -> engine inputs, engine outputs -> responses and stream chunks
    streaming.py    server-sent events, client disconnects
    protocol.py     pydantic request / response bodies
    served_model.py name, limits, tokenization of the served model
    metrics.py      Prometheus metrics
    auth.py         bearer-token gates
    errors.py       OpenAI-shaped errors
    config.py       ServerConfig
"""
