"""The cost model, above the code it models: alpha-beta cost of each collective (`collective_cost`), the
collectives a step issues under each layout (`step_traffic`), step time / throughput / memory projected from
them (`step_projection`), and the architectures it projects to (`model_shapes`). Constants that mirror a
behaviour of the code are imported from where the code defines them."""
