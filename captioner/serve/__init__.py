"""`captioner serve`: an HTTP API and a page to explore, word by word, where the model looked.

    app.py       the FastAPI app: /api/caption, /api/health, /api/model, the page
    batcher.py   concurrent requests batched onto one model thread
    uploads.py   multipart / raw uploads read into memory under a size limit
    static/      the page (HTML, CSS, JS; no build step, works offline) and example images
"""
