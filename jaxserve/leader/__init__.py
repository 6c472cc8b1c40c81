"""The leader of a multi-host run and its followers (step_channel.py): the leader's runner sends
every step to the followers before launching it on its own runner, and a follower launches the
steps it is sent on its runner. Both wrap the runner, so they sit above it; the hosts'
bootstrap (parallel/multihost.py: topology, fingerprint, errors) sits below it.
"""
