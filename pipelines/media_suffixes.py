"""Which file suffixes are images and which are videos: the names alone, with no imaging library, so that a request's
checks (pipelines.requests) and the API's uploads (app.server.openai_api) know an input's kind without importing numpy
or PIL, and pipelines.media reads files by the same lists."""

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
VIDEO_SUFFIXES = (".mp4", ".mov", ".webm", ".mkv", ".avi", ".gif")
