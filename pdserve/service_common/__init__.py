"""What the prefill and decode services share: proto <-> engine conversion, error mapping,
server bootstrap (limits, health, reflection) and the worker runtime (engine thread,
registration and prefix publishing in Redis)."""
