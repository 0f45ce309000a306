"""Peer stand-ins: small servers that speak SGLang's and vLLM's protocols as their own source
defines them (each module names the version and files it follows), for RemoteEngine's tests."""
