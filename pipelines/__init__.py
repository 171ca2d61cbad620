"""Request -> media: text encoding, denoising loop, VAE decode, output files (FLUX- and Cosmos-style)."""
