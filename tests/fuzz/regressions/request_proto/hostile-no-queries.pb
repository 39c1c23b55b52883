
dot_product