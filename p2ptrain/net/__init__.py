"""Drivers around the sans-IO core: the asyncio runtime, HTTP, discovery."""
