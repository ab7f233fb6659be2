"""The graph path of `backend_graph_compute`: a graph parsed by `apir.codec.graph`, checked
(records against the context's buffers, each node against its op's shape rule in `shapes`),
built into a `ggml_cgraph` (`build`), cached for the next token (`cache`) and computed.
`profiles` says which rules hold for which ggml backend."""
