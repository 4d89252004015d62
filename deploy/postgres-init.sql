-- One database per service: the analyzer and each shuffler keep separate state, as they
-- would on separate machines (docker-compose.yml mounts this into the PostgreSQL image).
CREATE DATABASE esa_analyzer;
CREATE DATABASE esa_shuffler_1;
CREATE DATABASE esa_shuffler_2;
CREATE DATABASE esa_shuffler_3;
