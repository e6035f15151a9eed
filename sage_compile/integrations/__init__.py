"""Opt-in integrations with model libraries; nothing here runs on ``import sage_compile``."""
