"""Process groups and meshes: how the ranks meet.

Owns the rendezvous and the default process group, with its timeouts, failure and teardown
(dist), where a rank's sockets listen (net), the DeviceMesh of a plan and the sub-groups cut
from it (mesh), a rank's steps in forming its group as the client drives them (join), the
start-up of a rank that is not an ipyparallel engine (launch) and the environment check behind
doctor() (doctor). Knows nothing of models, layouts, training or
inference; imports only runtime.rank (the state a group's facts are kept in).
"""
