"""Clients and measuring tools: ``cosyserve bench`` (:mod:`.bench`), ``cosyserve batch``
(:mod:`.batch`), ``cosyserve client`` (:mod:`.client`), the per-protocol request runners
(:mod:`.protocols`), benchmark manifests (:mod:`.manifest`) and the remote speech-LM client
for OpenAI-compatible completions servers (:mod:`.remote_lm`)."""
