"""`captioner serve`: an HTTP API and a page to explore, word by word, where the model looked.

    app.py       `create_app`: the FastAPI app, its lifespan (the model and its batcher on app.state)
    api.py       POST /api/caption, /api/visualize: an upload in, the caption JSON or the picture out
    info.py      GET /api/health, /api/model
    page.py      the page, the example images that suit the model
    deps.py      what the routes depend on: the app's objects, a request's decode options, the limits
    schemas.py   the Pydantic models of the answers (the schema /docs shows)
    errors.py    every error as JSON {"error": "..."}, an unexpected one as a JSON 500
    batcher.py   concurrent requests batched onto one model thread
    uploads.py   multipart / raw uploads read into memory under a size limit
    static/      the page (HTML, CSS, JS; no build step, works offline) and the shapes examples
"""
