"""Several layerpy instances on etcd: the etcd client, instance membership, node ownership by
etcd lease and the fence that lets only a node's owner act on it (docs/ha.md)."""
