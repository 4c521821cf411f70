"""The request side: what a run sends and what each answer must be.

scenario (the agent conversations, validated) -> stored_requests (each turn's exact bytes) ->
conversation (send, validate, retry, record) with long_input (documents sized to the server),
reuse_design (the prefix reuse the requests were built for, measured) and stream_equivalence (the
streamed/whole twin drill); plan holds the staged pressure they are played under, validate the checks
each answer goes through.
"""
