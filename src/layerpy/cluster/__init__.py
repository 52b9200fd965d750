"""Several layerpy instances as one cluster, on etcd: the client, the store's etcd backend,
instance membership, node ownership by etcd lease and the fence that lets only a node's owner
act on it (docs/ha.md)."""
