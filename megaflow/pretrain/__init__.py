"""ShapeEval pretraining: grammar-trained text encoders, a VAE trained on renders, the DiT through megatron-core."""
