"""Structured output: grammars compiled off the busy loop, masks before sampling (see manager.py)."""
