"""generative"""
