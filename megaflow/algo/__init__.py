"""The algorithms' math, pure torch: one module per algorithm (``flowgrpo``, ``nft``, ``awm``, ``dgpo``) and the
group advantages every algorithm shares (``advantages``). An algorithm's module imports no other algorithm's."""
