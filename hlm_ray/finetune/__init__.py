"""Fine-tuning: headless decoders into generators (`clm`); encoders into classifiers live in
`hlm_ray.classify`."""
