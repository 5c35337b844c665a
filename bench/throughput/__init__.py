"""throughput"""
