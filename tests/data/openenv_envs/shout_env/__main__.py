"""``python -m shout_env --port PORT --sessions N``: serve ShoutEnv on 127.0.0.1 with OpenEnv's own app."""

import argparse

import uvicorn
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation

from shout_env import ShoutEnv

ap = argparse.ArgumentParser()
ap.add_argument("--port", type=int, required=True)
ap.add_argument("--sessions", type=int, default=4)
args = ap.parse_args()
app = create_app(ShoutEnv, CallToolAction, CallToolObservation, env_name="shout_env", max_concurrent_envs=args.sessions)
uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")
