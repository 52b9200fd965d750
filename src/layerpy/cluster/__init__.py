"""Several layerpy instances as one cluster, on etcd: the client, the store's etcd backend."""
