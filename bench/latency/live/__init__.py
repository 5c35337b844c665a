"""latency/live"""
