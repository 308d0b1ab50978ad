-- GET /v1/orders pages through a tenant's orders newest first by (created_at, id): the
-- keyset of its cursor.
CREATE INDEX IF NOT EXISTS orders_tenant_created ON orders (tenant, created_at, id);
