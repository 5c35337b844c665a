"""latency/sim"""
