"""An OpenAI-compatible image and video API under /v1, on the UI's port (rank 0), for the `openai` package;
`serve --no-ui` serves it alone (app.server.api_server).

    POST   /v1/images/generations    text to image (n images: seeds seed, seed + 1, ...)
    POST   /v1/images/edits          text and a reference image to image (models that take one: FLUX.2)
    GET    /v1/models                the served models, with their media
    POST   /v1/videos                a video job (OpenAI's video shape); GET /v1/videos/{id} its status and
                                     progress, GET /v1/videos/{id}/content its MP4, DELETE stops and forgets it
    GET    /v1/videos                the caller's video jobs (after, limit, order), newest first
    GET    /v1/files/{name}?expires=T&sig=...  a result by the signed URL of response_format "url", until T

A request takes the UI's path (app.server.submit): make_request checks it, the time limit estimates it, it
waits in the one queue (server.jobs) beside the UI's requests, and its result is written with its
settings into the results folder. The settings come back in the response (`settings`). Every error is
OpenAI's shape, {"error": {"message", "type", "param", "code"}}, so the SDK raises its own classes:
400 a bad request (param names the field), 401 a wrong key, 403 the API is off (or a signed URL past its time),
404 unknown or another owner's, 405 a method the path does not take (OPTIONS: 204, with Allow), 409 a video not
ready, 413 an upload over --max-upload-mb, 429 the queue full (with Retry-After from the running jobs' estimates),
an owner's quota used up, or an address locked out after failed keys, 500 a failed generation, 503 a lost rank or a
server shutting down. Only a full queue is worth retrying: every other error tells the SDK not to
(x-should-retry: false).

Jobs are rows of the job store (app.server.job_store): a video job outlives a restart, and every job and file belongs to
the key that made it (Caller); another key gets 404 for it, an admin key (`KEY admin` in the key file) sees all.

Keys: with --api-key-file, every /v1 request but a signed file URL needs `Authorization: Bearer KEY`;
a wrong key is a failed login of its address (app.server.access). With UI logins but no keys the API is off
(403): a login protects the UI, and an open API beside it would bypass it. With neither, the API is
open, as the UI is. Field mapping, and what is ignored or refused: docs/openai-api.md.

With --webhook-url, a video job's end is posted as OpenAI's video.completed or video.failed event (app.server.webhooks),
tagged with the id of the request that created it (app.server.request_ids).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import math
import re
import shutil
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO

from starlette.datastructures import UploadFile
from starlette.requests import ClientDisconnect, Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import BaseRoute, Route

from app.outputs import RESULT_NAME
from app.ranks.lockstep import Generation
from app.ranks.runtime import Runtime, ServedModel
from app.server.access import LoginFailures
from app.server.job_store import JobRow
from app.server.jobs import Failed, Finished, Job, ServiceBusy, ServiceClosed
from app.server.request_ids import current_request_id, log
from app.server.submit import (
    OverQuota,
    Server,
    Submitted,
    failure_code,
    finish_later,
    public_message,
    random_seed,
    submit,
    write,
)
from app.server.webhooks import Webhooks
from pipelines.media_suffixes import IMAGE_SUFFIXES, VIDEO_SUFFIXES
from pipelines.requests import RequestError

PREFIX = "/v1"
MAX_IMAGES = 10
"""Most images one request may ask for (n), as OpenAI's own limit."""
CLIENT_CHECK_SECONDS = 0.5
"""How often a waiting handler asks whether its client is still connected (Job.follow's `every`)."""
POLL_AFTER_MS = 500
"""How often the SDK's videos.poll asks for a job's status (it reads the openai-poll-after-ms header)."""
FIELD_BYTES = 1_000_000
"""Room for a request's fields besides its upload (a prompt is at most 4000 characters)."""

OUR_FIELDS = {"seed", "steps", "guidance", "guidance_2", "negative_prompt", "step_cache", "quantized_attention",
              "lora"}
"""This server's own request fields (the SDK's extra_body); lora: the model's --lora names used, with scales
({"style": 0.8} or "style:0.8,detail"), default none."""
IMAGE_FIELDS = {"prompt", "model", "n", "size", "response_format", "output_format", "background", "stream"}
IMAGE_IGNORED = {"quality", "style", "moderation", "output_compression", "user", "safety_identifier",
                 "partial_images", "input_fidelity"}
VIDEO_FIELDS = {"prompt", "model", "seconds", "size", "input_reference", "frames", "fps"}
FIELD_PARAMS = {"n=": "n", "height": "size", "width": "size", "negative prompt": "negative_prompt", "frames": "frames",
                "fps": "fps", "steps": "steps", "guidance_2": "guidance_2", "guidance": "guidance", "seed": "seed",
                "prompt": "prompt", "step_cache": "step_cache",
                "quantized_attention": "quantized_attention", "input file": "image", "reference image": "image",
                "input image": "image", "input video": "image", "model": "image", "lora": "lora", "LoRA": "lora"}
"""The first words of make_request's problems -> the API field each names (the input: 'image' or
'input_reference', set per endpoint)."""


class ApiError(Exception):
    """An error a client gets in OpenAI's shape; `retry`: whether the SDK may try again (a full queue)."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, retry: bool = False, headers: dict[str, str] | None = None,
                 names_no_file: bool = False) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = {**(headers or {}), "x-should-retry": "true" if retry else "false"}
        self.names_no_file = names_no_file
        """The message names no server file (e.g. it quotes the client's URL path): it is sent as it is, where
        other messages have their absolute paths cut to their last part (public_message)."""

    def response(self) -> JSONResponse:
        message = self.message if self.names_no_file else public_message(self.message)
        body = {"error": {"message": message, "type": self.type, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def bad(message: str, param: str | None = None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def not_found(message: str, param: str | None = None) -> ApiError:
    return ApiError(404, message, type="not_found_error", param=param, code="not_found")


def refused(error: Exception, input_param: str = "image", frames_param: str = "frames") -> ApiError:
    """The ApiError for what submit raises: a bad request (400, naming its field), a full queue (429), a
    server that stops (503)."""
    if isinstance(error, ServiceBusy):
        return ApiError(429, str(error), type="rate_limit_error", code="queue_full", retry=True,
                        headers={"retry-after": str(math.ceil(error.retry_after))})
    if isinstance(error, OverQuota):
        return ApiError(429, str(error), type="rate_limit_error", code="quota_exceeded")
    if isinstance(error, ServiceClosed):
        return ApiError(503, str(error), type="server_error", code="server_shutting_down")
    problem = error.problems[0] if isinstance(error, RequestError) else str(error)
    param = next((name for words, name in FIELD_PARAMS.items() if problem.startswith(words)), None)
    param = {"image": input_param, "frames": frames_param}.get(param, param)
    return bad(str(error), param)


OPEN_OWNER = "anyone"
"""The owner of every job of an API that asks for no key: its clients are one."""


@dataclass(frozen=True)
class Caller:
    """Who sent a request: the owner its jobs and files get (app.server.job_store.JobRow.owner); an admin sees
    everyone's."""

    owner: str
    admin: bool = False

    def may_see(self, owner: str) -> bool:
        return self.admin or owner == self.owner


def key_owner(key: str) -> str:
    """The owner of an API key's jobs: a hash of it (the key itself is never stored)."""
    return f"key:{hashlib.sha256(key.encode()).hexdigest()[:24]}"


@dataclass(kw_only=True)
class ApiAccess:
    """Who may use the API: nobody (`off` says why), the holders of `keys` (those of `admins` see every owner's
    jobs), or (no keys) everyone, as one owner."""

    keys: list[str] | None
    failures: LoginFailures
    off: str | None = None
    admins: list[str] = field(default_factory=list)

    def check(self, request: Request) -> Caller:
        """Who sent `request`; ApiError unless it may use the API (a wrong key counts as a failed login of its
        address)."""
        if self.off is not None:
            raise ApiError(403, self.off, type="permission_error", code="api_off")
        if self.keys is None:
            return Caller(OPEN_OWNER)
        address = request.client.host if request.client else "unknown"
        wait = self.failures.lockout(address)
        if wait > 0:
            seconds = max(1, round(wait + 0.49))
            raise ApiError(429, f"too many failed logins from this address: try again in {seconds} s",
                           type="rate_limit_error", code="too_many_failed_logins",
                           headers={"retry-after": str(seconds)})
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        given_bytes = given.strip().encode()
        found = None
        for key in self.keys:  # every key compared, in constant time each
            if hmac.compare_digest(given_bytes, key.encode()):
                found = key
        if scheme.lower() != "bearer" or found is None:
            self.failures.failed(address)
            raise ApiError(401, "a valid API key is needed (Authorization: Bearer KEY; the server's --api-key-file)",
                           type="authentication_error", code="invalid_api_key")
        self.failures.succeeded(address)
        return Caller(key_owner(found), admin=found in self.admins)


def api_access(keys: list[str] | None, logins: bool, failures: LoginFailures, admins: list[str] | None = None
               ) -> ApiAccess:
    """Keys when given (`admins` among them see every owner's jobs); else off where the UI asks for a login (an open
    API would bypass it); else open."""
    off = None
    if keys is None and logins:
        off = ("this server's API is off: its UI asks for a login, and the API needs keys for that "
               "(start the server with --api-key-file FILE)")
    return ApiAccess(keys=keys, failures=failures, off=off, admins=list(admins or []))


def video_object(row: JobRow) -> dict[str, Any]:
    """A video job's row as OpenAI's video object, with this server's `settings`."""
    request = row.request
    return {
        "id": row.id, "object": "video", "model": row.model, "status": row.status, "progress": row.progress,
        "created_at": int(row.created_at), "completed_at": None if row.completed_at is None else int(row.completed_at),
        "expires_at": None if row.expires_at is None else int(row.expires_at), "prompt": request["prompt"],
        "seconds": f"{(request['frames'] - 1) / request['fps']:g}", "size": f"{request['width']}x{request['height']}",
        "remixed_from_video_id": None, "error": row.error, "settings": row.settings,
    }


class FileLinks:
    """URLs of result files that need no key, the way to share one: /v1/files/NAME?expires=T&sig=HMAC(NAME, T),
    with the store's secret (so that a URL outlives a restart), working until T (epoch seconds)."""

    def __init__(self, secret: bytes, seconds: float) -> None:
        self._secret = secret
        self.seconds = seconds

    def signature(self, name: str, expires: int) -> str:
        return hmac.new(self._secret, f"{name}:{expires}".encode(), hashlib.sha256).hexdigest()

    def url(self, request: Request, path: Path, not_after: float | None = None, now: float | None = None) -> str:
        """A URL of `path` for the next `seconds` (or until `not_after`, its job's expiry, where sooner)."""
        expires = int((time.time() if now is None else now) + self.seconds)
        if not_after is not None:
            expires = min(expires, int(not_after))
        base = str(request.base_url).rstrip("/")
        return f"{base}{PREFIX}/files/{path.name}?expires={expires}&sig={self.signature(path.name, expires)}"

    def check(self, name: str, expires: str, signature: str) -> None:
        """ApiError unless the URL's signature is right (404) and its time has not passed (403)."""
        valid = expires.isdigit() and hmac.compare_digest(self.signature(name, int(expires)), signature)
        if not valid:
            raise not_found("no such file")
        if int(expires) < time.time():
            when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(int(expires)))
            raise ApiError(403, f"this link expired at {when}: ask its owner for a new one", type="permission_error",
                           code="url_expired")


TAIL_BYTES = 256
"""How much of a body's end _LimitedBody keeps: room for a multipart form's closing boundary (70 characters at most)."""


class _LimitedBody:
    """A request's body, refused (413) once more than `max_bytes` of it arrive, whatever the request claims; its last
    TAIL_BYTES are kept (`tail`)."""

    def __init__(self, request: Request, max_bytes: int) -> None:
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > max_bytes:
            raise _too_large(max_bytes)
        self._receive = request.receive
        self._max_bytes = max_bytes
        self._received = 0
        self.tail = b""
        self.request = Request(request.scope, self.receive)
        """The request, reading its body through this."""

    async def receive(self) -> dict[str, Any]:
        message = await self._receive()
        if message["type"] == "http.request":
            chunk = message.get("body", b"")
            self._received += len(chunk)
            if self._received > self._max_bytes:
                raise _too_large(self._max_bytes)
            self.tail = (self.tail + chunk)[-TAIL_BYTES:]
        return message


def _ends_with_boundary(body: _LimitedBody, content_type: str) -> bool:
    """Whether `body`, read to its end, ends with its multipart form's closing boundary."""
    match = re.search(r'boundary="?([^";]+)"?', content_type)
    return match is not None and body.tail.rstrip(b"\r\n").endswith(f"--{match[1]}--".encode("latin-1"))


def _too_large(max_bytes: int) -> ApiError:
    return ApiError(413, f"the request is larger than this server's limit of {(max_bytes - FIELD_BYTES) / 1e6:g} MB "
                    "for an upload (--max-upload-mb)", code="request_too_large")


async def _fields(request: Request, max_bytes: int) -> tuple[dict[str, Any], dict[str, list[UploadFile]]]:
    """A request's fields and files, from a JSON object or a multipart form."""
    received = _LimitedBody(request, max_bytes)
    limited = received.request
    try:
        if request.headers.get("content-type", "").startswith("multipart/form-data"):
            form = await limited.form(max_files=8, max_fields=64, max_part_size=FIELD_BYTES)
            if not _ends_with_boundary(received, request.headers["content-type"]):
                # python-multipart takes a cut form as complete, without its last, unfinished part
                await form.close()
                raise bad("the multipart form ends before its closing boundary (the body was cut short)")
            fields: dict[str, Any] = {}
            files: dict[str, list[UploadFile]] = {}
            for name, value in form.multi_items():
                if isinstance(value, UploadFile):
                    files.setdefault(name.removesuffix("[]"), []).append(value)
                else:
                    fields[name] = value
            return fields, files
        try:
            body = await limited.json()
        except ValueError:
            raise bad("the body is not JSON (send a JSON object, or a multipart form)") from None
        except RecursionError:  # json's decoder recurses once per level of nesting
            raise bad("the body's JSON is nested too deeply (a request's fields are one object of plain "
                      "values)") from None
    except ClientDisconnect:
        raise ApiError(400, "the client went away") from None
    except ApiError:
        raise
    except Exception as error:  # Starlette's multipart errors: a malformed form is the client's
        raise bad(f"the form cannot be read: {error}") from None
    if not isinstance(body, dict):
        raise bad("the body must be a JSON object")
    return body, {}


def _check_fields(fields: dict[str, Any], accepted: set[str]) -> None:
    unknown = sorted(set(fields) - accepted)
    if unknown:
        raise bad(f"unknown field {unknown[0]!r} (docs/openai-api.md lists what this server takes)", unknown[0],
                  "unknown_parameter")


def _model(runtime: Runtime, media: str, name: Any) -> ServedModel:
    """The served model of `media` that `name` names (None: the one there is)."""
    model = runtime.models.get(media)
    served = ", ".join(f"{served.spec.name} ({served.spec.media})" for served in runtime.models.values())
    if model is None:
        raise bad(f"this server runs no {media} model (it serves {served})", "model", "model_not_found")
    if name not in (None, "", model.spec.name):
        raise bad(f"model {name!r} is not served here; {media}s come from {model.spec.name!r} (served: {served})",
                  "model", "model_not_found")
    return model


def _size(text: Any) -> tuple[int | None, int | None]:
    """'WxH' -> (width, height); None or 'auto' -> the model's default."""
    if text in (None, "", "auto"):
        return None, None
    match = re.fullmatch(r"\s*(\d+)\s*x\s*(\d+)\s*", str(text))
    if match is None:
        raise bad(f"size must look like WIDTHxHEIGHT (e.g. 512x512) or be 'auto', got {text!r}", "size")
    return int(match[1]), int(match[2])


def _whole(name: str, value: Any) -> int:
    """`value` (a JSON number or a form's text) as a whole number; 400 naming `name` otherwise."""
    text = str(value).strip()
    if re.fullmatch(r"-?\d+", text):
        return int(text)
    try:
        number = float(text)
    except ValueError:
        number = float("nan")
    if not number.is_integer():
        raise bad(f"{name} must be a whole number, got {value!r}", name)
    return int(number)


def _our_fields(fields: dict[str, Any]) -> dict[str, Any]:
    return {name: fields[name] for name in OUR_FIELDS if name in fields}


async def _save(server: Server, name: str, write: Callable[[BinaryIO], object]) -> Path:
    """A new upload `name`, written by `write`, in the server's upload folder (a folder of its own, so that its name
    is the client's), held by this handler until it releases it."""
    folder = server.uploads.folder / f"api-{uuid.uuid4().hex}"
    path = folder / name

    def save() -> None:
        folder.mkdir()
        with path.open("wb") as out:
            write(out)

    await asyncio.to_thread(save)
    server.uploads.use(path)
    return path


async def _save_upload(server: Server, upload: UploadFile) -> Path:
    """An uploaded file in the server's upload folder (closed once copied), held as _save holds it."""
    name = re.sub(r"[^\w.-]", "_", Path(upload.filename or "input").name)[-100:] or "input"
    path = await _save(server, name, partial(shutil.copyfileobj, upload.file, length=1 << 20))
    await upload.close()
    return path


async def _save_data_url(server: Server, url: str, max_bytes: int) -> Path:
    """An input given as a base64 data URL (data:image/png;base64,...) in the server's upload folder, held as _save
    holds it."""
    match = re.fullmatch(r"data:(image|video)/([\w.+-]+);base64,(.*)", url.strip(), re.S)
    if match is None:
        raise bad("input_reference's image_url must be a base64 data URL (data:image/png;base64,...): this server "
                  "fetches nothing from the network", "input_reference")
    try:
        data = base64.b64decode(match[3], validate=True)
    except ValueError:  # binascii.Error is one
        raise bad("input_reference's data URL is not valid base64", "input_reference") from None
    if len(data) > max_bytes - FIELD_BYTES:
        raise _too_large(max_bytes)
    suffix = {"jpeg": ".jpg", "quicktime": ".mov"}.get(match[2], f".{match[2]}")
    if suffix not in IMAGE_SUFFIXES + VIDEO_SUFFIXES:
        raise bad(f"input_reference's data URL has a type this server does not read ({match[1]}/{match[2]})",
                  "input_reference")
    return await _save(server, f"input_reference{suffix}", lambda out: out.write(data))


async def _result(job: Job, gone: Callable[[], Awaitable[bool]]) -> Generation:
    """`job`'s result, waited for without blocking the loop; ApiError if it fails; the job cancelled if `gone()` says
    the client left, or if this coroutine is cancelled."""
    async for event in job.follow(gone, CLIENT_CHECK_SECONDS):
        if isinstance(event, Failed):
            raise _failed(event.message)
        if isinstance(event, Finished):
            return event.generation
    raise RuntimeError("the job's events ended without its result")  # Job.follow ends with Finished or Failed


def _failed(message: str) -> ApiError:
    # app.server.jobs and app.server.serve say "the server lost a rank ..." / "the server is shutting down": nothing to
    # retry here
    if failure_code(message) == "server_unavailable":
        return ApiError(503, message, type="server_error", code="server_unavailable")
    return ApiError(500, message, type="server_error", code="generation_failed")


def api_endpoint(handler: Callable[[Request], Awaitable[Response]], access: ApiAccess | None
                 ) -> Callable[[Request], Awaitable[Response]]:
    """`handler` behind the key check (None: no check; else the Caller in request.state.caller), its ApiErrors
    answered in OpenAI's shape."""

    async def endpoint(request: Request) -> Response:
        try:
            if access is not None:
                request.state.caller = access.check(request)
            return await handler(request)
        except ApiError as error:
            return error.response()

    return endpoint


ANY_METHOD = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]


def unmatched(prefix: str, routes: list[BaseRoute]) -> Route:
    """The route that answers a request under `prefix` that none of `routes` took (under /v1, and everywhere with
    --no-ui), whatever its method, in OpenAI's shape: a path no route has, 404; a path some route has, OPTIONS 204
    and any other method 405, with the methods it takes in `Allow`."""

    async def endpoint(request: Request) -> Response:
        path = request.url.path
        allowed = {method for route in routes if isinstance(route, Route) and route.methods
                   and route.path_regex.match(path) for method in route.methods}
        if not allowed:
            raise ApiError(404, f"no endpoint {request.method} {path} here (docs/openai-api.md lists them)",
                           type="not_found_error", code="unknown_url", names_no_file=True)
        allow = ", ".join(sorted(allowed | {"OPTIONS"}))
        if request.method == "OPTIONS":
            return Response(status_code=204, headers={"allow": allow})
        raise ApiError(405, f"{path} takes {allow}, not {request.method}", type="invalid_request_error",
                       code="method_not_allowed", headers={"allow": allow}, names_no_file=True)

    return Route(f"{prefix}/{{path:path}}", api_endpoint(endpoint, None), methods=ANY_METHOD)


@dataclass(frozen=True, kw_only=True)
class ApiContext:
    """What the /v1 handlers share: the models, the server (queue, time limit, results, uploads, store) they share
    with the UI, who may call them, the body's limit, the signed file URLs, and where a video job's end is told."""

    runtime: Runtime
    server: Server
    access: ApiAccess
    max_bytes: int
    """The most a request's body may bring: the upload limit (--max-upload-mb) and room for its fields."""
    links: FileLinks
    webhooks: Webhooks | None = None
    """Where a video job's end is told (video.completed, video.failed); None: nowhere."""
    created: int = field(default_factory=lambda: int(time.time()))
    """When the routes were made: the served models' `created`."""
    video_requests: dict[str, str | None] = field(default_factory=dict)
    """A video job's id -> the id of the request that created it, which its end's log line and webhook carry."""


def api_routes(runtime: Runtime, server: Server, access: ApiAccess, max_upload_bytes: int,
               webhooks: Webhooks | None = None) -> list[BaseRoute]:
    """The /v1 routes for `runtime`'s models, sharing `server` (queue, time limit, results, uploads) with the UI;
    `webhooks`: where a video job's end is told (video.completed, video.failed)."""
    api = ApiContext(runtime=runtime, server=server, access=access, max_bytes=max_upload_bytes + FIELD_BYTES,
                     links=FileLinks(server.store.secret(), server.quotas.url_seconds), webhooks=webhooks)
    server.store.subscribe(partial(video_ended, api))

    def route(path: str, handler: Callable[[ApiContext, Request], Awaitable[Response]], methods: list[str],
              keyed: bool = True) -> Route:
        return Route(f"{PREFIX}{path}", api_endpoint(partial(handler, api), api.access if keyed else None),
                     methods=methods)

    endpoints = [
        route("/models", models, ["GET"]),
        route("/images/generations", generations, ["POST"]),
        route("/images/edits", edits, ["POST"]),
        route("/videos", create_video, ["POST"]),
        route("/videos", list_videos, ["GET"]),
        route("/videos/{video_id}", retrieve_video, ["GET"]),
        route("/videos/{video_id}", delete_video, ["DELETE"]),
        route("/videos/{video_id}/content", video_content, ["GET"]),
        route("/files/{name}", result_file, ["GET"], keyed=False),  # the signature is the key
    ]
    # Anything else under /v1 is this API's to answer, whatever its method (Gradio's routes never see it).
    return [*endpoints, unmatched(PREFIX, endpoints)]


def video_ended(api: ApiContext, row: JobRow) -> None:
    """The store's listener: a video job that completed (its MP4 written) or failed is logged, and told to the
    webhook (in the thread that ended it; Webhooks.send only queues the event)."""
    if row.kind != "video" or row.status not in ("completed", "failed"):
        return
    request_id = api.video_requests.pop(row.id, None)
    reason = f": {row.error['message']}" if row.error else ""
    log.info("video %s %s%s", row.id, row.status, reason, extra={"video_id": row.id, "request_id": request_id})
    if api.webhooks is not None:
        api.webhooks.send(f"video.{row.status}", {"id": row.id}, request_id)


def _video_of(api: ApiContext, request: Request) -> JobRow:
    """The caller's video job of the path's id: 404 for an unknown one and for another owner's alike."""
    video_id = request.path_params["video_id"]
    row = api.server.store.get(video_id)
    if row is None or row.kind != "video" or not request.state.caller.may_see(row.owner):
        raise not_found(f"no video {video_id!r} (unknown, deleted, expired, or not yours)", "video_id")
    return row


async def models(api: ApiContext, request: Request) -> Response:
    """GET /v1/models: the served models, with their media, default size and what they take."""
    data = [{"id": model.spec.name, "object": "model", "created": api.created, "owned_by": "ulysses-studio",
             "media": model.spec.media, "default_size": f"{model.spec.width}x{model.spec.height}",
             "size_multiple": model.limits.size_multiple,
             "takes_input": (model.limits.video_input if model.spec.media == "video" else model.limits.reference_image),
             "loras": dict(model.limits.loras)} for model in api.runtime.models.values()]
    return JSONResponse({"object": "list", "data": data})


async def generations(api: ApiContext, request: Request) -> Response:
    """POST /v1/images/generations: images from text."""
    fields, files = await _fields(request, api.max_bytes)
    if files:
        raise bad("images/generations takes no file: send a reference image to images/edits", "image")
    return await _images(api, request, fields, None)


async def edits(api: ApiContext, request: Request) -> Response:
    """POST /v1/images/edits: images from text and one reference image (models that take one)."""
    fields, files = await _fields(request, api.max_bytes)
    if "mask" in files or "mask" in fields:
        raise bad("mask: this server does not inpaint; the image is a reference for the whole picture", "mask",
                  "unsupported_value")
    given = files.get("image", [])
    if len(given) != 1 or set(files) - {"image"}:
        raise bad(f"images/edits takes one reference image (field 'image'), got {len(given)}", "image")
    model = _model(api.runtime, "image", fields.get("model"))
    if not model.limits.reference_image:
        raise bad(f"model '{model.spec.name}' makes images from text alone; it takes no input image", "image")
    path = await _save_upload(api.server, given[0])  # this handler's hold; each job takes its own (app.server.submit)
    try:
        return await _images(api, request, fields, path)
    finally:
        await asyncio.to_thread(api.server.uploads.release, path)


async def _images(api: ApiContext, request: Request, fields: dict[str, Any], condition: Path | None) -> Response:
    """The images of a generation or an edit (`condition`: its reference image), once they are all made."""
    model, count, response_format = _image_options(api, fields, condition)
    submitted = await _submit_images(api, request, model, count, fields, condition)
    data = await _image_items(api, request, model, submitted, response_format)
    first = submitted[0].request
    return JSONResponse({"created": int(time.time()), "data": data, "output_format": "png",
                         "size": f"{first.width}x{first.height}", "background": "opaque"})


def _image_options(api: ApiContext, fields: dict[str, Any], condition: Path | None) -> tuple[ServedModel, int, str]:
    """An image request's model, its number of images (n) and its response_format; 400 for what this server does
    not take."""
    accepted = IMAGE_FIELDS | IMAGE_IGNORED | OUR_FIELDS | ({"image"} if condition is not None else set())
    _check_fields(fields, accepted)
    model = _model(api.runtime, "image", fields.get("model"))
    count = 1 if fields.get("n") in (None, "") else _whole("n", fields["n"])
    if not 1 <= count <= MAX_IMAGES:
        raise bad(f"n must be between 1 and {MAX_IMAGES}, got {count}", "n")
    jobs = api.server.jobs
    room = min(jobs.max_waiting, jobs.per_owner or jobs.max_waiting)
    if count > room:
        raise bad(f"n={count} is more images than this server queues for one client ({room}: --max-queue "
                  f"{jobs.max_waiting}, --max-queue-per-owner {jobs.per_owner}): ask for at most {room}", "n")
    response_format = fields.get("response_format") or "b64_json"
    if response_format not in ("b64_json", "url"):
        raise bad(f"response_format must be 'b64_json' or 'url', got {response_format!r}", "response_format")
    if fields.get("output_format") not in (None, "", "png"):
        raise bad("output_format: this server writes PNG alone", "output_format", "unsupported_value")
    if fields.get("background") == "transparent":
        raise bad("background: this server's images are opaque", "background", "unsupported_value")
    if fields.get("stream") not in (None, False, "false", "False"):
        raise bad("stream: this server answers once the images are made (no partial images)", "stream",
                  "unsupported_value")
    return model, count, response_format


async def _submit_images(api: ApiContext, request: Request, model: ServedModel, count: int, fields: dict[str, Any],
                         condition: Path | None) -> list[Submitted]:
    """Queue the `count` jobs of an image request (seeds seed, seed + 1, ...): all of them, or none."""
    width, height = _size(fields.get("size"))
    seed = random_seed() if fields.get("seed") in (None, "") else _whole("seed", fields["seed"])
    ours = {**_our_fields(fields), "seed": seed}
    submitted: list[Submitted] = []
    try:
        for index in range(count):
            ours["seed"] = seed + index
            submitted.append(await submit(model, api.server, owner=request.state.caller.owner, copies=count,
                                          prompt=fields.get("prompt"), width=width, height=height,
                                          condition=None if condition is None else str(condition), **ours))
    except (RequestError, ServiceBusy, ServiceClosed, OverQuota) as error:
        for queued in submitted:
            queued.job.cancel("another image of its request was refused")
        raise refused(error) from None
    return submitted


async def _image_items(api: ApiContext, request: Request, model: ServedModel, submitted: list[Submitted],
                       response_format: str) -> list[dict[str, Any]]:
    """Each job's image, as it ends, written and given as a signed URL or base64; one that fails, or a client that
    leaves, cancels the rest."""
    data = []
    try:
        for queued in submitted:
            generation = await _result(queued.job, request.is_disconnected)
            path, settings = await write(model, api.server, queued, generation)
            item: dict[str, Any] = {"revised_prompt": None, "settings": settings}
            if response_format == "url":
                item["url"] = api.links.url(request, path, api.server.store.get(queued.id).expires_at)
            else:
                item["b64_json"] = base64.b64encode(await asyncio.to_thread(path.read_bytes)).decode()
            data.append(item)
    except BaseException:
        for queued in submitted:  # one failed, or the client left: the rest are not wanted either
            queued.job.cancel("another image of its request failed")
        raise
    return data


async def create_video(api: ApiContext, request: Request) -> Response:
    """POST /v1/videos: queue a video job (finished by a thread of its own) and answer its video object at once."""
    fields, files = await _fields(request, api.max_bytes)
    reference = _video_reference(fields)
    _check_fields(fields, VIDEO_FIELDS | OUR_FIELDS)
    if set(files) - {"input_reference"} or len(files.get("input_reference", [])) > 1:
        raise bad("a video request takes one file, input_reference", "input_reference")
    model = _model(api.runtime, "video", fields.get("model"))
    width, height = _size(fields.get("size"))
    frames, fps = _video_length(fields, model)
    seed = random_seed() if fields.get("seed") in (None, "") else fields["seed"]
    path = await _video_input(api, files, reference)
    try:
        submitted = await submit(model, api.server, owner=request.state.caller.owner, prompt=fields.get("prompt"),
                                 width=width, height=height, frames=frames, fps=fps,
                                 condition=None if path is None else str(path), **{**_our_fields(fields), "seed": seed})
    except (RequestError, ServiceBusy, ServiceClosed, OverQuota) as error:
        raise refused(error, "input_reference", "seconds" if "seconds" in fields else "frames") from None
    finally:
        if path is not None:
            await asyncio.to_thread(api.server.uploads.release, path)
    api.video_requests[submitted.id] = current_request_id()
    finish_later(model, api.server, submitted)
    return JSONResponse(video_object(await asyncio.to_thread(api.server.store.get, submitted.id)))


def _video_reference(fields: dict[str, Any]) -> Any:
    """The input_reference a video request gives in its fields (an image_url data URL), taken out of them; None where
    it gives none (or sends it as a file)."""
    given = fields.pop("input_reference[image_url]", None) or fields.pop("input_reference", None)
    reference = given.get("image_url") if isinstance(given, dict) else given
    if (isinstance(given, dict) and reference is None) or "input_reference[file_id]" in fields:
        raise bad("input_reference: give an uploaded file or an image_url data URL (no file ids here)",
                  "input_reference")
    return reference


def _video_length(fields: dict[str, Any], model: ServedModel) -> tuple[int | None, int | None]:
    """A video request's frames and fps (None: the model's default), its frames from `seconds` where it gives them."""
    fps = None if fields.get("fps") in (None, "") else _whole("fps", fields["fps"])
    frames = None if fields.get("frames") in (None, "") else _whole("frames", fields["frames"])
    if fields.get("seconds") not in (None, ""):
        if frames is not None:
            raise bad("give seconds or frames, not both", "frames")
        frames = _frames_of(fields["seconds"], fps or model.spec.fps, model.limits.frame_multiple)
    return frames, fps


async def _video_input(api: ApiContext, files: dict[str, list[UploadFile]], reference: Any) -> Path | None:
    """A video request's input (an uploaded file, or its data URL) in the upload folder, held by this handler until
    it releases it; None where it gives none."""
    if files.get("input_reference"):
        return await _save_upload(api.server, files["input_reference"][0])
    if reference is not None:
        return await _save_data_url(api.server, str(reference), api.max_bytes)
    return None


async def list_videos(api: ApiContext, request: Request) -> Response:
    """GET /v1/videos: the caller's video jobs (every owner's for an admin), a page after an id, in either order."""
    query = request.query_params
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad(f"order must be 'asc' or 'desc', got {order!r}", "order")
    limit = _whole("limit", query.get("limit", "20"))
    if not 1 <= limit <= 100:
        raise bad(f"limit must be between 1 and 100, got {limit}", "limit")
    caller = request.state.caller
    after = query.get("after") or None
    if after is not None:
        row = api.server.store.get(after)
        if row is None or row.kind != "video" or not caller.may_see(row.owner):
            raise bad(f"after: no video {after!r} of yours", "after")
    rows, more = await asyncio.to_thread(api.server.store.page, None if caller.admin else caller.owner, "video",
                                         after=after, limit=limit, order=order)
    data = [video_object(row) for row in rows]
    return JSONResponse({"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                         "last_id": data[-1]["id"] if data else None, "has_more": more})


async def retrieve_video(api: ApiContext, request: Request) -> Response:
    """GET /v1/videos/{id}: its video object, and how often to ask again."""
    return JSONResponse(video_object(_video_of(api, request)), headers={"openai-poll-after-ms": str(POLL_AFTER_MS)})


async def video_content(api: ApiContext, request: Request) -> Response:
    """GET /v1/videos/{id}/content: a completed video's MP4."""
    video = _video_of(api, request)
    variant = request.query_params.get("variant", "video")
    if variant != "video":
        raise ApiError(400, f"variant {variant!r}: this server keeps the MP4 alone ('video')", param="variant",
                       code="unsupported_value")
    if video.status != "completed":
        message = video.error["message"] if video.error else "its MP4 is not ready yet"
        raise ApiError(409, f"video {video.id} is {video.status}: {message}", code="video_not_ready")
    path = api.server.results.folder / video.files[0] if video.files else None
    if path is None or not path.is_file():
        raise not_found(f"video {video.id}'s file was removed (the server keeps its latest results: --keep-results)")
    return FileResponse(path, media_type="video/mp4")


async def delete_video(api: ApiContext, request: Request) -> Response:
    """DELETE /v1/videos/{id}: stop the job if it waits or runs, and forget it and its file."""
    server = api.server
    video = _video_of(api, request)
    job = server.live.get(video.id)
    if job is not None:
        job.cancel("deleted by the client")
    if video.status in ("queued", "in_progress"):  # it ends unfinished: its row says so (a video.failed event)
        await asyncio.to_thread(server.store.change, video.id, status="failed", completed_at=time.time(),
                                error={"code": "cancelled", "message": "deleted by its owner before it ended"})
    await asyncio.to_thread(server.store.delete, video.id)
    for name in video.files:
        await asyncio.to_thread((server.results.folder / name).unlink, missing_ok=True)
    return JSONResponse({"id": video.id, "object": "video.deleted", "deleted": True})


async def result_file(api: ApiContext, request: Request) -> Response:
    """GET /v1/files/{name}: a result by its signed URL, until the URL's time."""
    name = request.path_params["name"]
    if not RESULT_NAME.fullmatch(name):
        raise not_found("no such file")
    api.links.check(name, request.query_params.get("expires", ""), request.query_params.get("sig", ""))
    path = api.server.results.folder / name
    if not path.is_file():
        raise not_found(f"{name} was removed (the server keeps its latest results: --keep-results)")
    return FileResponse(path, media_type="image/png" if name.endswith(".png") else "video/mp4")


def _frames_of(seconds: Any, fps: int, multiple: int) -> int:
    """A clip of `seconds`: its frames after the first span seconds x fps frame intervals, rounded to the model's
    grid (1 + a multiple of `multiple`)."""
    try:
        length = float(seconds)
    except (TypeError, ValueError):
        length = float("nan")
    if not length > 0 or length == float("inf"):
        raise bad(f"seconds must be a number above 0, got {seconds!r}", "seconds")
    return 1 + max(1, round(length * fps / multiple)) * multiple
