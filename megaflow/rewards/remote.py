"""Remote scorers as rewards: a reward server over HTTP, and a vision-language model as a judge.

Design notes: docs/design/rewards.md.
"""
from __future__ import annotations

import base64
import contextlib
import http.client
import io
import json
import logging
import math
import os
import pickle
import re
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from megaflow.rewards.base import ImageBatch, Reward, to_pil

logger = logging.getLogger("megaflow.rewards")

DEFAULT_QUESTION = 'Does this image match the description "{prompt}"? Answer yes or no.'
DEADLINE_S = 120.0  # default total seconds of one request, retries included
MAX_ANSWER_BYTES = 16 << 20  # default cap of an answer (scores of a batch, or one judge's reply: a few KB)
PROGRESS_S = 15.0  # a waiting request says so this often
_CHUNK = 1 << 16
_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)")
_WORD = re.compile(r"[a-z]+")


def check_url(name: str, url: object) -> str:
    """``url`` if it is an http(s) URL with a host; else a one-line ValueError naming the reward."""
    parts = urllib.parse.urlsplit(url) if isinstance(url, str) else None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"reward {name!r}: url must be an http(s) URL with a host, got {url!r}")
    return url


def _check_common(name: str, timeout: object, retries: object, backoff: object, deadline: object = DEADLINE_S,
                  max_answer_bytes: object = MAX_ANSWER_BYTES) -> None:
    for key, value in (("timeout", timeout), ("deadline", deadline)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 86400:
            raise ValueError(f"reward {name!r}: {key} must be a number of seconds in (0, 86400], got {value!r}")
    if isinstance(max_answer_bytes, bool) or not isinstance(max_answer_bytes, int) or max_answer_bytes < 1:
        raise ValueError(f"reward {name!r}: max_answer_bytes must be an integer >= 1, got {max_answer_bytes!r}")
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        raise ValueError(f"reward {name!r}: retries must be an integer >= 0, got {retries!r}")
    if isinstance(backoff, bool) or not isinstance(backoff, (int, float)) or backoff < 0:
        raise ValueError(f"reward {name!r}: backoff must be a number of seconds >= 0, got {backoff!r}")


def jpegs(images: ImageBatch, quality: int = 95) -> list[bytes]:
    """Each image of the batch as JPEG bytes (RGB, ``quality``)."""
    out = []
    for im in to_pil(images):
        buf = io.BytesIO()
        im.save(buf, format="JPEG", quality=quality)
        out.append(buf.getvalue())
    return out


class AnswerTooLarge(OSError):
    """An answer over the reward's ``max_answer_bytes`` (refused unread; not retried)."""


def _read_capped(answer, max_bytes: int, end: float) -> bytes:
    """The answer's body, at most ``max_bytes`` (its Content-Length checked first) and by the monotonic time
    ``end``; AnswerTooLarge or TimeoutError otherwise."""
    announced = answer.headers.get("Content-Length")
    if announced is not None and announced.isdigit() and int(announced) > max_bytes:
        raise AnswerTooLarge(f"it announces {int(announced)} bytes, more than max_answer_bytes = {max_bytes}")
    parts, size = [], 0
    while chunk := answer.read1(_CHUNK):  # what has arrived: a trickle cannot hold it past the deadline
        size += len(chunk)
        if size > max_bytes:
            raise AnswerTooLarge(f"more than max_answer_bytes = {max_bytes} bytes")
        if time.monotonic() > end:
            raise TimeoutError(f"its transfer was still going at the deadline ({size} bytes in)")
        parts.append(chunk)
    return b"".join(parts)


@contextlib.contextmanager
def _saying_while_waiting(name: str, url: str, deadline: float):
    """A warning every PROGRESS_S seconds while the block runs (requests waiting on a server; ``deadline``: each
    request's, for the message)."""
    done, t0 = threading.Event(), time.monotonic()

    def say() -> None:
        while not done.wait(PROGRESS_S):
            logger.warning("reward %s: still waiting for %s (%.0f s of the %g s deadline)", name, url,
                           time.monotonic() - t0, deadline)
    threading.Thread(target=say, name=f"megaflow-reward-{name}-progress", daemon=True).start()
    try:
        yield
    finally:
        done.set()


# Hand-written on http.client, not httpx or requests (neither is a declared dependency: httpx only comes with
# sglang): what such a client would add here is the retries with backoff, one deadline across them, an answer read in
# chunks up to a size cap and a "still waiting" line, each tested in tests/rewards/test_remote.py.
def post(url: str, body: bytes, *, content_type: str, timeout: float, retries: int, backoff: float,
         name: str, headers: dict | None = None, deadline: float = DEADLINE_S,
         max_answer_bytes: int = MAX_ANSWER_BYTES, say_progress: bool = True) -> bytes | None:
    """The answer's body to a POST of ``body``, or None (with a warning) after ``1 + retries`` failed attempts
    (a connection error, a timeout or an HTTP error status each count as one), when ``deadline`` seconds have
    passed, or at once for an answer over ``max_answer_bytes``; (``say_progress``) a warning every PROGRESS_S
    seconds while it waits."""
    request = urllib.request.Request(url, data=body, method="POST",
                                     headers={"Content-Type": content_type, **(headers or {})})
    error: Exception | None = None
    end, tries = time.monotonic() + deadline, 0
    with _saying_while_waiting(name, url, deadline) if say_progress else contextlib.nullcontext():
        for attempt in range(retries + 1):
            if attempt:
                time.sleep(max(0.0, min(backoff * 2 ** (attempt - 1), end - time.monotonic())))
            left = end - time.monotonic()
            if left <= 0:
                error = TimeoutError(f"the deadline of {deadline:g} s passed")
                break
            tries += 1
            try:
                with urllib.request.urlopen(request, timeout=min(timeout, left)) as answer:
                    return _read_capped(answer, max_answer_bytes, end)
            except AnswerTooLarge as e:
                error = e
                break
            except (OSError, http.client.HTTPException) as e:  # URLError, HTTPError and timeouts are OSErrors
                error = e
    logger.warning("reward %s: POST %s failed %d time(s), last with %s: %s; its samples are masked",
                   name, url, tries, type(error).__name__, error)
    return None


def judge_score(text: str, max_score: float = 1.0) -> float:
    """The judge rule (the module's design notes): "yes" / "no" -> 1 / 0, else the first number / ``max_score`` in
    [0, 1]; ValueError otherwise."""
    word = _WORD.match(text.strip().lower().lstrip("\"'*`([ "))
    if word and word.group() in ("yes", "no"):
        return 1.0 if word.group() == "yes" else 0.0
    number = _NUMBER.search(text)
    if number is None:
        raise ValueError(f"no yes/no and no number in the answer {text[:80]!r}")
    value = float(number.group()) / max_score
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"answer {text[:80]!r} gives {value:g}, outside [0, 1] (max_score {max_score:g})")
    return value


def _nan(num: int) -> torch.Tensor:
    return torch.full((num,), float("nan"))


def _item_score(item: object, name: str, i: int) -> float:
    """One item of a server's ``scores`` / ``outputs`` as a float (NaN, with a warning, when unusable)."""
    try:
        if isinstance(item, str):
            return judge_score(item)
        value = float(item)
        return value if math.isfinite(value) else float("nan")
    except (TypeError, ValueError) as e:
        logger.warning("reward %s: unusable score for sample %d (%s): masked", name, i, e)
        return float("nan")


class RemoteReward(Reward):
    """A reward server (the module's design notes): ``url``, ``format`` ("pickle" needs ``trust_pickle = true``, or
    "json"), ``timeout`` / ``retries`` / ``backoff`` / ``deadline`` (seconds, attempts after the first, first
    wait, a request's total), ``max_answer_bytes``, ``jpeg_quality`` of the images sent."""

    name = "remote"

    def __init__(self, *, url: str, format: str = "pickle", trust_pickle: bool = False, timeout: float = 60.0,
                 retries: int = 2, backoff: float = 1.0, jpeg_quality: int = 95, deadline: float = DEADLINE_S,
                 max_answer_bytes: int = MAX_ANSWER_BYTES):
        if format not in ("pickle", "json"):
            raise ValueError(f"reward {self.name!r}: format must be 'pickle' or 'json', got {format!r}")
        if format == "pickle" and trust_pickle is not True:
            raise ValueError(f"reward {self.name!r}: the pickle protocol unpickles the server's answer, which runs "
                             "any code the server sends; set trust_pickle = true for a server you trust, or use "
                             "format = 'json' (the 'remote_json' reward)")
        if format == "json" and trust_pickle:
            raise ValueError(f"reward {self.name!r}: trust_pickle is for format = 'pickle' only")
        _check_common(self.name, timeout, retries, backoff, deadline, max_answer_bytes)
        if isinstance(jpeg_quality, bool) or not isinstance(jpeg_quality, int) or not 1 <= jpeg_quality <= 100:
            raise ValueError(f"reward {self.name!r}: jpeg_quality must be an integer in [1, 100], got {jpeg_quality!r}")
        self.url, self.format, self.quality = check_url(self.name, url), format, jpeg_quality
        self.limits = dict(timeout=float(timeout), retries=retries, backoff=float(backoff), deadline=float(deadline),
                           max_answer_bytes=max_answer_bytes)

    def _body(self, images: ImageBatch, prompts: list[str], meta: list[dict]) -> tuple[bytes, str]:
        data = jpegs(images, self.quality)
        if self.format == "pickle":
            body = {"images": data, "prompts": prompts, "meta_datas": meta}
            return pickle.dumps(body), "application/octet-stream"
        body = {"images": [base64.b64encode(b).decode("ascii") for b in data], "prompts": prompts, "meta_datas": meta}
        return json.dumps(body, default=str).encode(), "application/json"

    def _decode(self, raw: bytes) -> list:
        answer = pickle.loads(raw) if self.format == "pickle" else json.loads(raw)  # noqa: S301 - trust_pickle
        if not isinstance(answer, dict) or not isinstance(answer.get("scores", answer.get("outputs")), list):
            raise ValueError(f"expected a dict with a 'scores' or 'outputs' list, got {type(answer).__name__}"
                             + (f" with keys {sorted(map(str, answer))}" if isinstance(answer, dict) else ""))
        return answer["scores"] if "scores" in answer else answer["outputs"]

    def __call__(self, images: ImageBatch, prompts: Sequence[str],
                 metadata: Sequence[dict] | None = None) -> torch.Tensor:
        num = len(prompts)
        meta = [dict(m) for m in metadata] if metadata is not None else [{} for _ in range(num)]
        body, content_type = self._body(images, list(prompts), meta)
        raw = post(self.url, body, content_type=content_type, name=self.name, **self.limits)
        if raw is None:
            return _nan(num)
        try:
            items = self._decode(raw)
        except Exception as e:  # noqa: BLE001 - a bad answer masks the batch, never stops the run
            logger.error("reward %s: cannot decode the answer of %s (%s: %s): %d samples masked",
                         self.name, self.url, type(e).__name__, e, num)
            return _nan(num)
        if len(items) != num:
            logger.error("reward %s: %s answered %d scores for %d samples: all %d masked",
                         self.name, self.url, len(items), num, num)
            return _nan(num)
        return torch.tensor([_item_score(x, self.name, i) for i, x in enumerate(items)], dtype=torch.float32)


class RemoteJsonReward(RemoteReward):
    """``remote`` with ``format = "json"`` (no trust flag needed)."""

    name = "remote_json"

    def __init__(self, *, url: str, timeout: float = 60.0, retries: int = 2, backoff: float = 1.0,
                 jpeg_quality: int = 95, deadline: float = DEADLINE_S, max_answer_bytes: int = MAX_ANSWER_BYTES):
        super().__init__(url=url, format="json", timeout=timeout, retries=retries, backoff=backoff,
                         jpeg_quality=jpeg_quality, deadline=deadline, max_answer_bytes=max_answer_bytes)


def chat_url(url: str) -> str:
    """The chat-completions endpoint of a server URL (kept when it already ends in ``/chat/completions``)."""
    return url if url.rstrip("/").endswith("/chat/completions") else url.rstrip("/") + "/v1/chat/completions"


# The OpenAI-compatible chat call is one POST through ``post`` (its deadline, retries and answer cap), not the
# ``openai`` client: that is not a declared dependency and keeps retry and timeout rules of its own.
class VlmJudge(Reward):
    """A VLM's answer to ``question`` about each image, scored by the judge rule (the module's design notes);
    ``concurrency`` requests in flight at most, each with ``RemoteReward``'s limits."""

    name = "vlm_judge"

    def __init__(self, *, url: str, model: str, question: str = DEFAULT_QUESTION, timeout: float = 60.0,
                 retries: int = 2, backoff: float = 1.0, max_score: float = 1.0, max_tokens: int = 16,
                 concurrency: int = 8, api_key_env: str | None = None, deadline: float = DEADLINE_S,
                 max_answer_bytes: int = MAX_ANSWER_BYTES):
        if not isinstance(model, str) or not model:
            raise ValueError(f"reward {self.name!r}: model must be the served model's name, got {model!r}")
        if not isinstance(question, str) or not question.strip():
            raise ValueError(f"reward {self.name!r}: question must be a non-empty string, got {question!r}")
        _check_common(self.name, timeout, retries, backoff, deadline, max_answer_bytes)
        if isinstance(max_score, bool) or not isinstance(max_score, (int, float)) or not max_score > 0:
            raise ValueError(f"reward {self.name!r}: max_score must be a number > 0, got {max_score!r}")
        for key, value in (("max_tokens", max_tokens), ("concurrency", concurrency)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"reward {self.name!r}: {key} must be an integer >= 1, got {value!r}")
        self.headers = {}
        if api_key_env is not None:
            if not os.environ.get(api_key_env):
                raise ValueError(f"reward {self.name!r}: api_key_env names {api_key_env!r}, which is not set")
            self.headers["Authorization"] = f"Bearer {os.environ[api_key_env]}"
        self.url, self.model, self.question = chat_url(check_url(self.name, url)), model, question
        self.limits = dict(timeout=float(timeout), retries=retries, backoff=float(backoff), deadline=float(deadline),
                           max_answer_bytes=max_answer_bytes)
        self.max_score, self.max_tokens, self.concurrency = float(max_score), max_tokens, concurrency

    def request(self, jpeg: bytes, prompt: str) -> dict:
        """The chat-completions request body for one image and its prompt."""
        image = "data:image/jpeg;base64," + base64.b64encode(jpeg).decode("ascii")
        content = [{"type": "image_url", "image_url": {"url": image}},
                   {"type": "text", "text": self.question.replace("{prompt}", prompt)}]
        return {"model": self.model, "messages": [{"role": "user", "content": content}],
                "max_tokens": self.max_tokens, "temperature": 0}

    def _one(self, i: int, jpeg: bytes, prompt: str) -> float:
        raw = post(self.url, json.dumps(self.request(jpeg, prompt)).encode(), content_type="application/json",
                   name=self.name, headers=self.headers, say_progress=False, **self.limits)
        if raw is None:
            return float("nan")
        try:
            text = json.loads(raw)["choices"][0]["message"]["content"]
            return judge_score(str(text), self.max_score)
        except Exception as e:  # noqa: BLE001 - one bad answer masks its sample
            logger.warning("reward %s: sample %d (prompt %r) masked: %s: %s", self.name, i, prompt,
                           type(e).__name__, e)
            return float("nan")

    def __call__(self, images: ImageBatch, prompts: Sequence[str],
                 metadata: Sequence[dict] | None = None) -> torch.Tensor:
        data = jpegs(images)
        with _saying_while_waiting(self.name, self.url, self.limits["deadline"]), \
                ThreadPoolExecutor(max_workers=max(1, min(self.concurrency, len(data)))) as pool:
            scores = list(pool.map(self._one, range(len(data)), data, prompts))
        return torch.tensor(scores, dtype=torch.float32)
