"""Comparison workers for `dialog-worker bench --compare` (not shipped in the wheel).

Every module here consumes the same inbound stream format as dialog-worker (entries written by
lua/send-3.lua), uses the same engine (dialog_worker.engine.rules.load_rules) and writes the same
state JSON shape and reply fields, so the bench drives and checks all of them the same way.
"""
