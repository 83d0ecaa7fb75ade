"""restarts"""
