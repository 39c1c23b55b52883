
dot_product
€€€€€€€€