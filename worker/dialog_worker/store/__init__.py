"""The Redis layer: the connection, every key name, the Lua scripts, the checks a worker makes
of its Redis, the wire format of entries and the readers of stream entries.
"""
