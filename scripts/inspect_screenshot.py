"""Take docs/inspect.png: ``relayrl inspect`` over a demo run, in headless Chromium, a token hovered.

    bash scripts/demo.sh && python scripts/inspect_screenshot.py runs/demo/grpo docs/inspect.png

The page opens at step 12 (a GRPO group with wrong members), colours tokens by the generator's
logprob and hovers the first token of the first rollout, so the picture shows the curves, a group side
by side with rewards and advantages, coloured tokens and one token's values.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys

from relayrl.inspector.headless import chromium


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir")
    ap.add_argument("out")
    ap.add_argument("--step", type=int, default=12)
    args = ap.parse_args()
    cmd = [sys.executable, "-m", "relayrl.cli", "inspect", args.run_dir, "--port", "0"]
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert server.stdout is not None
        url = next(m.group(0) for line in server.stdout if (m := re.search(r"http://127\.0\.0\.1:\d+/", line)))
        with chromium(width=1200, height=860) as ctx:
            page = ctx.new_page()
            page.goto(f"{url}#run=0&step={args.step}")
            page.wait_for_selector(".rollout .tok")
            page.select_option("#colour", "logp")
            page.locator(".rollout .tok[data-k='1']").first.hover()
            page.screenshot(path=args.out)
    finally:
        server.terminate()
        server.wait()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
