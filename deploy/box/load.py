"""Completions requests to a served model, from the client: one every 0.5 s for SECONDS, each
answer's status and latency, and what a request without the key gets.

    python deploy/box/load.py http://198.18.1.1:8000 KEY 60     # one JSON line at the end
"""

from __future__ import annotations

import json
import sys
import threading
import time
import urllib.error
import urllib.request


def ask(url: str, key: str | None, timeout: float = 90.0) -> tuple[int | str, float]:
    body = json.dumps({"prompt": "The history of", "max_tokens": 8}).encode()
    headers = {"content-type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    started = time.perf_counter()
    request = urllib.request.Request(f"{url}/v1/completions", data=body, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            reply.read()
            code: int | str = reply.status
    except urllib.error.HTTPError as err:
        code = err.code
    except OSError as err:
        code = type(err).__name__
    return code, round(time.perf_counter() - started, 2)


def main(url: str, key: str, seconds: float) -> None:
    start = time.perf_counter()
    answers: list = []

    def one() -> None:
        sent = round(time.perf_counter() - start, 1)
        answers.append((sent, *ask(url, key)))

    threads = []
    while time.perf_counter() - start < seconds or not threads:
        threads.append(threading.Thread(target=one))
        threads[-1].start()
        time.sleep(0.5)
    for thread in threads:
        thread.join()
    unauthorized = ask(url, None)[0]
    print(json.dumps({"requests": sorted(answers), "unauthorized": unauthorized}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]))
