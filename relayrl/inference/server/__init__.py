"""``relayrl serve``: the HTTP app around LocalEngine (SGLang-style and OpenAI routes, weight routes)
and the launcher of such servers. Kept light: Ray's server actors import the launcher."""

LISTEN_PREFIX = "relayrl server listening on "  # `relayrl serve` prints it with its URL once bound
