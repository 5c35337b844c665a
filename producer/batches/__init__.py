"""OpenAI batch jobs on Redis: files, batches and the runner that admits their lines.

keys.py names every key (a batch's keys share one slot), lines.py and objects.py are pure
(input lines in, worker payloads and OpenAI's objects out), store.py holds the Redis calls
(each state change one transaction or script), runner.py the lease-holding loop.
"""
