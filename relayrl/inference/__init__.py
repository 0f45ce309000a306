"""Generation: LocalEngine in process, `relayrl serve`, RemoteEngine to servers, and launching them."""

LISTEN_PREFIX = "relayrl server listening on "  # `relayrl serve` prints it with its URL once bound
