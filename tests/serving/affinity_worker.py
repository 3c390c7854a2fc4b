"""A worker process for the gateway tests: a class-aware mock engine. Prints its URL, then serves until killed.

    python affinity_worker.py '{"hangul-prose": 0.95}' [gateway_url token]
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from serving_engines import ClassAwareMock  # noqa: E402

from moe_offload.serving import server, worker  # noqa: E402

rates = json.loads(sys.argv[1])
sock = server.bind("127.0.0.1", 0)
url = server.url_of(sock)
app = worker.create_app(ClassAwareMock(rates), model_name="mock")
if len(sys.argv) > 3:
    import threading

    from moe_offload.serving.gateway import register

    threading.Thread(target=register, args=(sys.argv[2], sys.argv[3], url), kwargs={"model": "mock"}, daemon=True).start()
print(url, flush=True)
server.run_server(app, sock, log_level="warning")
